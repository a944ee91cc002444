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
"""

from __future__ import annotations

import json
import zlib
from collections import defaultdict
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import numpy as np

from . import _stats as stats
from ._records import Result
from .checkers import Answer, Grader, derived_record, normalize

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
    return text[:head] + "\n" + text[len(text) - (PROMPT_KEEP_CHARS - head):]


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
            parts += [p["text"] for p in content
                      if isinstance(p, Mapping) and isinstance(p.get("text"), str)]
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
    return GradingSpec(record.id, record.task, record.check,
                       zlib.compress(text.encode("utf-8", "surrogatepass"), 6) if text else b"")


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
        "normalized": exact or (normalize(r.output_text) == normalize(ref.output_text)
                                and calls == ref_calls),
        "first_divergence": first_divergence(r.output_ids, ref.output_ids)
        if r.output_ids or ref.output_ids else (None if exact else 0),
    }


def grade_rows(results: Sequence[Result], requests: Mapping[str, Gradable],
               reference: str, grader: Grader | None = None) -> list[dict[str, Any]]:
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
        row: dict[str, Any] = {"target": r.target, "phase": r.phase, "request_id": r.request_id,
                               "bucket": r.bucket, "answered": r.status == "ok",
                               "task": req.task if req else None, "grade": None,
                               "agreement": None, "derived": None}
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
                    grade = grader.grade_derived(Answer(ref.output_text, tuple(ref.tool_calls)),
                                                 Answer(r.output_text, tuple(r.tool_calls)),
                                                 prompt_text(req))
                    row["derived"] = derived_record(grade, row["agreement"]["normalized"])
        rows.append(row)
    return rows


def _rate(values: Iterable[bool]) -> float | None:
    v = list(values)
    return sum(v) / len(v) if v else None


def _pairs(rows_t: Mapping[str, Mapping[str, Any]], rows_ref: Mapping[str, Mapping[str, Any]],
           ) -> tuple[list[bool], list[bool]]:
    """Checker outcomes of the requests both targets answered and graded (ref, target)."""
    a, b = [], []
    for rid, row in rows_t.items():
        ref = rows_ref.get(rid)
        if row["grade"] is not None and ref is not None and ref["grade"] is not None:
            a.append(bool(ref["grade"]["passed"]))
            b.append(bool(row["grade"]["passed"]))
    return a, b


def compare(rows_t: Mapping[str, Mapping[str, Any]], rows_ref: Mapping[str, Mapping[str, Any]],
            tolerance: float, seed: int, *, alpha: float = stats.ALPHA,
            min_pairs: int = stats.MIN_PAIRS) -> dict[str, Any]:
    """Pass rate, paired difference to the reference, McNemar, agreement, evidence.

    ``evidence`` is :func:`stats.evidence` under the verdict's rule (``tolerance``, ``alpha``,
    ``min_pairs``): whether these pairs show a loss or a drop bounded below the tolerance,
    and only while they show neither, how many pairs would."""
    graded = [r["grade"]["passed"] for r in rows_t.values() if r["grade"] is not None]
    k, n = sum(graded), len(graded)
    a, b = _pairs(rows_t, rows_ref)
    out: dict[str, Any] = {"answered": sum(r["answered"] for r in rows_t.values()),
                           "requests": len(rows_t), "graded": n, "passed": k,
                           "pass_rate": k / n if n else None, "wilson": stats.wilson(k, n)}
    diff = stats.paired_bootstrap([float(x) for x in a], [float(x) for x in b], seed=seed)
    mc = stats.mcnemar_exact(a, b)
    out["vs_reference"] = None if diff is None else {
        "pairs": diff.n, "diff": diff.diff, "lo": diff.lo, "hi": diff.hi,
        "mcnemar_p": mc.p_value, "ref_only": mc.a_only, "target_only": mc.b_only}
    agree = [r["agreement"] for r in rows_t.values() if r["agreement"] is not None]
    divs = [x["first_divergence"] for x in agree if x["first_divergence"] is not None]
    out["agreement"] = {"compared": len(agree),
                        "exact": _rate(x["exact"] for x in agree),
                        "normalized": _rate(x["normalized"] for x in agree),
                        "first_divergence_median": float(np.median(divs)) if divs else None}
    ev = stats.evidence(len(a), mc.a_only, mc.b_only, tolerance=tolerance, alpha=alpha,
                        min_pairs=min_pairs)
    out["evidence"] = ev.to_json()
    return out


def compare_derived(rows_t: Mapping[str, Mapping[str, Any]],
                    rows_control: Mapping[str, Mapping[str, Any]] | None,
                    seed: int) -> dict[str, Any]:
    """Derived grades of one target: pass rate, counts (by rule, ungraded, checker errors), the
    normalized exact rate beside them, and ``vs_control``: the paired comparison with the A/A
    control's derived grades of the same requests, its floor (None for the control itself, the
    reference, or when no control ran)."""
    recs = [(rid, r["derived"]) for rid, r in rows_t.items() if r.get("derived")]
    graded = [(rid, d) for rid, d in recs if d["passed"] is not None]
    k, n = sum(bool(d["passed"]) for _, d in graded), len(graded)
    by_rule: dict[str, dict[str, int]] = {}
    for _, d in recs:
        counts = by_rule.setdefault(str(d["rule"]), {"graded": 0, "passed": 0, "ungraded": 0})
        if d["passed"] is None:
            counts["ungraded"] += 1
        else:
            counts["graded"] += 1
            counts["passed"] += bool(d["passed"])
    out: dict[str, Any] = {
        "graded": n, "passed": k, "pass_rate": k / n if n else None,
        "wilson": stats.wilson(k, n), "ungraded": len(recs) - n,
        "checker_errors": sum(bool((d.get("detail") or {}).get("checker_error"))
                              for _, d in recs),
        "by_rule": dict(sorted(by_rule.items())),
        "exact_rate": _rate(bool(d["exact"]) for _, d in recs if d.get("exact") is not None),
        "vs_control": None}
    if rows_control is None:
        return out
    a, b = [], []
    for rid, d in graded:
        floor = (rows_control.get(rid) or {}).get("derived")
        if floor and floor["passed"] is not None:
            a.append(bool(floor["passed"]))
            b.append(bool(d["passed"]))
    diff = stats.paired_bootstrap([float(x) for x in a], [float(x) for x in b], seed=seed)
    mc = stats.mcnemar_exact(a, b)
    out["vs_control"] = None if diff is None else {
        "pairs": diff.n, "control_pass_rate": diff.mean_a, "pass_rate": diff.mean_b,
        "diff": diff.diff, "lo": diff.lo, "hi": diff.hi, "mcnemar_p": mc.p_value,
        "control_only": mc.a_only, "target_only": mc.b_only}
    return out


def combined_pairs(rows_t: Mapping[str, Mapping[str, Any]],
                   rows_ref: Mapping[str, Mapping[str, Any]],
                   rows_control: Mapping[str, Mapping[str, Any]] | None,
                   ) -> tuple[list[bool], list[bool], int]:
    """Every graded pair of one target and bucket, explicit and derived pooled, and how many
    are derived. A request is one pair at most: with a check, its grade against the
    reference's (explicit checks win); without one, its derived grade (agreement with the
    reference's answer) against the A/A control's derived grade of the same request, the
    reference agreeing with itself. Without a control the baseline is a pass: every
    disagreement with the reference counts against the candidate, the conservative reading
    (no noise floor)."""
    a, b = _pairs(rows_t, rows_ref)
    derived = 0
    for rid, row in rows_t.items():
        d = row.get("derived")
        if row["grade"] is not None or not d or d["passed"] is None:
            continue
        if rows_control is None:
            base = True
        else:
            floor = (rows_control.get(rid) or {}).get("derived")
            if not floor or floor["passed"] is None:
                continue
            base = bool(floor["passed"])
        a.append(base)
        b.append(bool(d["passed"]))
        derived += 1
    return a, b, derived


def compare_combined(rows_t: Mapping[str, Mapping[str, Any]],
                     rows_ref: Mapping[str, Mapping[str, Any]],
                     rows_control: Mapping[str, Mapping[str, Any]] | None,
                     tolerance: float, seed: int, *, alpha: float = stats.ALPHA,
                     min_pairs: int = stats.MIN_PAIRS) -> dict[str, Any] | None:
    """The paired comparison the verdict decides on: ``combined_pairs`` under the same
    statistics and evidence rule as the explicit grades alone."""
    a, b, derived = combined_pairs(rows_t, rows_ref, rows_control)
    diff = stats.paired_bootstrap([float(x) for x in a], [float(x) for x in b], seed=seed)
    if diff is None:
        return None
    mc = stats.mcnemar_exact(a, b)
    ev = stats.evidence(len(a), mc.a_only, mc.b_only, tolerance=tolerance, alpha=alpha,
                        min_pairs=min_pairs)
    return {"pairs": diff.n, "explicit": diff.n - derived, "derived": derived,
            "baseline": "control" if rows_control is not None else "pass",
            "diff": diff.diff, "lo": diff.lo, "hi": diff.hi, "mcnemar_p": mc.p_value,
            "ref_only": mc.a_only, "target_only": mc.b_only, "evidence": ev.to_json()}


def teacher_forced(tf: Mapping[str, Mapping[str, Any]], tf_ref: Mapping[str, Mapping[str, Any]],
                   ids: Iterable[str], seed: int = 0) -> dict[str, Any]:
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
    nll_ci = stats.paired_bootstrap([0.0] * len(per_request), per_request, seed=seed)
    top1_ci = stats.paired_bootstrap([0.0] * len(top1_per_request), top1_per_request, seed=seed)
    return {"tokens": len(deltas), "requests": len(per_request), "errors": errors,
            "nll_delta_mean": float(np.mean(deltas)) if deltas else None,
            "nll_delta_lo": None if nll_ci is None else nll_ci.lo,
            "nll_delta_hi": None if nll_ci is None else nll_ci.hi,
            "top1_agreement": _rate(top1),
            "top1_lo": None if top1_ci is None else top1_ci.lo,
            "top1_hi": None if top1_ci is None else top1_ci.hi,
            "identical_to_reference": bool(deltas) and all(d == 0.0 for d in deltas)}


def checker_error_notes(rows: Iterable[Mapping[str, Any]]) -> list[str]:
    """One note per target (and kind of grade) whose answers could not all be graded (they
    count as failed)."""
    notes = []
    for key, what in (("grade", "answer(s)"), ("derived", "derived grade(s)")):
        errors: dict[str, dict[str, int]] = defaultdict(lambda: defaultdict(int))
        first: dict[str, str] = {}
        for row in rows:
            kind = ((row.get(key) or {}).get("detail") or {}).get("checker_error")
            if kind:
                errors[row["target"]][kind] += 1
                first.setdefault(row["target"], f"{row['request_id']}: {row[key]['reason']}")
        notes += [f"{target}: {sum(kinds.values())} {what} failed with a checker error "
                  f"({', '.join(f'{k} {n}' for k, n in sorted(kinds.items()))}); first: "
                  f"{first[target]}" for target, kinds in errors.items()]
    return notes


def quality(rows: Sequence[Mapping[str, Any]], tf_rows: Sequence[Mapping[str, Any]],
            reference: str, bucket_order: Sequence[str], tolerance: float = stats.TOLERANCE,
            seed: int = 0, *, alpha: float = stats.ALPHA,
            min_pairs: int = stats.MIN_PAIRS) -> dict[str, Any]:
    """phase -> target -> {buckets: {...}, all: {...}, shift: {...}} plus notes. ``tolerance``,
    ``alpha`` and ``min_pairs`` are the verdict's, so the evidence column says what it says."""
    by: dict[str, dict[str, dict[str, Mapping[str, Any]]]] = defaultdict(
        lambda: defaultdict(dict))
    for row in rows:
        by[row["phase"]][row["target"]][row["request_id"]] = row
    tf: dict[str, dict[str, Any]] = defaultdict(dict)
    for t in tf_rows:
        tf[t["target"]][t["request_id"]] = t
    out: dict[str, Any] = {"reference": reference, "tolerance": tolerance, "alpha": alpha,
                           "min_pairs": min_pairs, "phases": {}, "notes": []}
    control = reference + CONTROL_SUFFIX
    for phase, targets in by.items():
        ref_rows = targets.get(reference, {})
        p_out: dict[str, Any] = {}
        for target, t_rows in targets.items():
            floor_rows = None if target in (reference, control) else targets.get(control)
            buckets = sorted({r["bucket"] for r in t_rows.values()},
                             key=lambda b: bucket_order.index(b) if b in bucket_order else 99)
            t_out: dict[str, Any] = {"buckets": {}, "all": compare(
                t_rows, ref_rows, tolerance, seed, alpha=alpha, min_pairs=min_pairs)}
            strata = []
            for b in buckets:
                sub = {k: v for k, v in t_rows.items() if v["bucket"] == b}
                row = compare(sub, ref_rows, tolerance, seed, alpha=alpha, min_pairs=min_pairs)
                row["derived"] = compare_derived(sub, floor_rows, seed)
                if target not in (reference, control):
                    row["combined"] = compare_combined(sub, ref_rows, floor_rows, tolerance,
                                                       seed, alpha=alpha, min_pairs=min_pairs)
                row["teacher_forced"] = teacher_forced(tf.get(target, {}), tf.get(reference, {}),
                                                       sub, seed)
                t_out["buckets"][b] = row
                # The shift test pools what the verdict decides on: explicit and derived.
                strata.append(combined_pairs(sub, ref_rows, floor_rows)[:2])
            shift = stats.stratified_shift(strata) if target != reference else None
            t_out["shift"] = None if shift is None else {
                "p_value": shift.p_value, "direction": shift.direction,
                "ref_only": shift.a_only, "target_only": shift.b_only, "pairs": shift.n}
            t_out["teacher_forced"] = teacher_forced(tf.get(target, {}), tf.get(reference, {}),
                                                     t_rows)
            t_out["all"]["derived"] = compare_derived(t_rows, floor_rows, seed)
            p_out[target] = t_out
        if control not in targets and any(r.get("derived") for t in targets.values()
                                          for r in t.values()):
            out["notes"].append(
                f"{phase}: derived grades have no noise floor: no A/A control ({control}) ran, "
                "so every disagreement with the reference's answer counts against the "
                "candidate (--control gives the floor)")
        if control in p_out:
            for t_out in p_out.values():
                for b, row in t_out["buckets"].items():
                    floor = p_out[control]["buckets"].get(b)
                    row["noise_floor"] = None if floor is None else {
                        "diff": (floor["vs_reference"] or {}).get("diff"),
                        "lo": (floor["vs_reference"] or {}).get("lo"),
                        "hi": (floor["vs_reference"] or {}).get("hi"),
                        "agreement_exact": floor["agreement"]["exact"],
                        "nll_delta_mean": floor["teacher_forced"]["nll_delta_mean"],
                        "nll_delta_hi": floor["teacher_forced"]["nll_delta_hi"],
                        "top1_lo": floor["teacher_forced"]["top1_lo"]}
        out["phases"][phase] = p_out
    out["notes"] += checker_error_notes(rows)
    for phase, p_out in out["phases"].items():
        for target, t_out in p_out.items():
            tf = t_out["teacher_forced"]
            if target not in (reference, control) and tf["identical_to_reference"]:
                out["notes"].append(
                    f"{phase}/{target}: teacher-forced scores are identical to {reference}'s: "
                    "this path does not exercise a different KV cache on this backend; it is "
                    "not evidence of no loss")
    return out
